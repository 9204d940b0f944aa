"""ops: the kernels floor (frozen and quantized linears, batch-invariant tiles, the native C kernels). It imports no
other engine room; the rooms above build on it. See docs/engine.md's file map."""
