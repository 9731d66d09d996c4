"""The simulator: `ledger simulate`'s faulty workload against reference agents, and its summary."""
