"""Benchmark suites. Each module has `run(result, quick=False, save=...)`, which appends rows to
result["rows"] (and calls save() after each); kernels are imported only when a suite runs."""
