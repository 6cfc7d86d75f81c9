"""Notifiers: the channels events are announced on (console, Slack, email, Alertmanager, webhook), one module each
beside the `Notifier` interface in `base`; `text` holds the words every channel shares, `http` the delivery the
webhook-style channels share.

May import: trainguard.core.
"""
