"""Performance benchmarks of jupyter-gpushare (docs/performance.md; run_campaign.py runs them)."""
