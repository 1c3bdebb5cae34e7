"""Code the tests share (no test module imports another test module or a benchmark script)."""
