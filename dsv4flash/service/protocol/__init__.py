"""The Tinker REST protocol as SDK 0.38 speaks it: routes, protobuf/zstd bodies and schema glue (schemas
imported from `tinker`), MinT's extensions, the ASGI app and the `dsv4flash serve` CLI."""
