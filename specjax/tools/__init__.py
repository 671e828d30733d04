"""Tools on top of the API: benchmark, reports, tuning, peer engines, comparisons."""
