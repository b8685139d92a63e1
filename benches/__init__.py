"""rtxdsl's benchmarks (pytest-benchmark) and reports (``python -m benches.<report>``)."""
