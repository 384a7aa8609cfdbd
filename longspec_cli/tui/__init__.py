"""Textual front ends: `longspec monitor` and the `longspec init` wizard.

Only monitor_app.py, wizard_app.py and widgets/ import textual, and only when they run. The pure
helpers here (tail, series, follow, views, alerts, sysinfo, wizard_checks) stay importable without
it, so `longspec monitor --once` and the tests of the rules need no terminal UI at all.
"""
