"""The accuracy-vs-footprint harness behind `kvtier eval` (metrics, windows, sweep, report)."""
