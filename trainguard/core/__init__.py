"""The shared vocabulary, at the bottom of every import: statuses, results and metric samples (`model`), incident
events (`events`), structured logging (`logs`), units and settings types, running external tools (`tools`), small
files written whole and read with care (`files`), and the pure helpers that evaluate numbers (`forecast`,
`thresholds`) or wake at a deadline (`timer`).

May import: the standard library and third-party packages only, never another trainguard package.
"""
