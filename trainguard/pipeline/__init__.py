"""The pipeline, in the order data flows through it:

    runner      a check's run, with its time budget, as a RunReport (failure turned into data)
    incidents   results -> incidents with hysteresis -> events (fired, escalated, reminder, resolved)
    store       incidents and the outbox, written in one SQLite transaction
    dispatch    the outbox delivered to the notifiers, one worker per channel
    responder   the actions bound to a check, run on its events
    engine      builds the checks and wires the parts above; schedule: when each check runs
    config      what a validated config is (reading the TOML file belongs to the daemon shell: agent.configfile)

May import: trainguard.core, the sources (node, gpu, jobs, logscan, quota), checks, actions, notifiers, registry.
"""
