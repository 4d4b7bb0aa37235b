"""Reporting: run folders read back, tables, paired comparisons, study statistics, findings, figures."""
