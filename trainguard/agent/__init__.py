"""The daemon shell around the pipeline: reading the TOML config file (`configfile`), `trainguard run` (`daemon`), the HTTP
endpoint (`http`: /metrics through `metrics`, /healthz, /status through `status`) and systemd notifications.

May import: the pipeline and everything below it.
"""
