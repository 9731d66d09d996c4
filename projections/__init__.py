"""Pure folds over the log: what every view of the state is (docs/events.md, Projections).

base         the Projection contract, decode-once folding, state hashes
ledger       groups -> siblings -> tries, unpaid ACK debts per agent
checkpoints  every checkpoint, its outcome, cut position and prepare wait
recovery     RolloutRecoveryState (the snapshot) and the restore plan
audit        the invariants of docs/events.md, one named rule each
runner       live projections from a subscription, projection checkpoints, rebuilds
timeline     one sibling's history (`ledger show`); swimlane renders it as HTML
"""
