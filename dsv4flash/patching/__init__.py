"""Runtime twins: the machinery that applies upstream fixes to installed upstream packages at run time.

Modules: `twins` (the `@runtime_patch` registry of runtime twins, the `Patcher`, twin discovery), `post_import` (act on a
module right after it is imported), `predicate` (`Remove-When` version conditions). The patch-series tooling
(`dsv4flash.patchseries`) imports these; nothing here imports it. Nothing is imported here, so that
`import dsv4flash` (which registers a post-import hook) loads only `post_import`.
"""
