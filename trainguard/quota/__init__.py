"""Quotas: parsers of the quota tools' real output (`parsers`), one provider per tool (`providers`, listed in the
registry's QUOTA_PROVIDERS), and the incremental directory-budget walker (`budget`).

May import: trainguard.core.
"""
