"""The benchmark runner that benchmark.py starts, a module per duty: the rows (rows.py), the command
line and plan (options.py), the estimates (estimate.py), the launches (run.py), where it ran
(provenance.py), and the table, chart and publishing (report.py). Planning imports no torch."""
