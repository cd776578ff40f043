"""The upstream patch series: parse `patches/<upstream>/`, fetch pinned releases, check, index, patched copies.

Modules: `series` (patch files, trailers, base.txt; `Remove-When` is read with the runtime's
`dsv4flash.patching.predicate`), `fetch` (pinned release from the package index, cached), `gitops` (apply
alone / as a series in a scratch git repository), `check` (the `dsv4flash patches check` pipeline), `index`
(generated README.md and series.toml), `copies` (a patched copy of an upstream package on a temporary path),
`testing` (pytest harness that runs a runtime twin's tests against that copy). Nothing here imports an
upstream framework; the runtime twin machinery (`dsv4flash.patching`) never imports this package.
"""
