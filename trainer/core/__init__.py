"""The hand-off protocol's decisions, with no I/O (sans-I/O, in the manner of h11 and h2).

Each module holds one state machine as pure functions: (state folded from the log or from the answers
so far, one input: an agent's answer, a timer firing, an operator command) -> a decision (events to
append, calls to make, a wait).  Nothing here reads a clock, draws a random number, awaits or touches
the network or the store: the time and the jitter draw are inputs.  The async shell in `trainer/`
performs what a decision names and feeds the answers back, so what recovery plans and what a driver
does are the same code, and every transition is tested without a server (tests/core/).

    retry        one retry budget (calls, deadline, jittered backoff) and its verdicts: in
                 `protocol/retry.py`, below the workers too, which ride out outages with it
    checkpoint   a participant's prepare, commit/resume and abort steps; the checkpoint's decision
    attempt      retire answers, adoption checks and when an attempt is declared lost
    group        replace, abandon or dead-letter after an attempt failed (two budgets: infra and data)
    debt         what an ACK answer proves: paid, refused, dropped on evidence of a newer generation
    retire_debt  a retire owed to an agent for an attempt declared lost there: what its answer proves
"""
