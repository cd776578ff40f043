"""Adapter catalog: `open_catalog("path/catalog.sqlite")` or `open_catalog("postgresql://…")`."""

from __future__ import annotations

import os

from dsv4flash.lifecycle.catalog.base import ANY_HEAD, HEAD, Catalog, PolicyRecord, RevisionRecord, StateRecord, TagMove

__all__ = ["open_catalog", "is_database_url", "Catalog", "PolicyRecord", "RevisionRecord", "StateRecord", "TagMove",
           "ANY_HEAD", "HEAD"]


def is_database_url(text: str) -> bool:
    """A PostgreSQL URL or libpq keyword string (else a SQLite path or `sqlite:///path`)."""
    return text.startswith(("postgresql://", "postgres://")) or ("dbname=" in text and "=" in text.split()[0])


def open_catalog(url: str | os.PathLike) -> Catalog:
    """A catalog by URL: `postgresql://…`/`postgres://…`/libpq `host=… dbname=…`, `sqlite:///path` or a path."""
    text = os.fspath(url)
    if is_database_url(text):
        from dsv4flash.lifecycle.catalog.postgres import PostgresCatalog

        return PostgresCatalog(text)
    from dsv4flash.lifecycle.catalog.sqlite import SQLiteCatalog

    return SQLiteCatalog(text.removeprefix("sqlite:///") if text.startswith("sqlite:///") else text)
