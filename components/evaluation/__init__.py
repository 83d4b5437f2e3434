"""Evaluation on held-out suites, the HTML report, and the promotion gate."""
