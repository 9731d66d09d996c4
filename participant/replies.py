"""The agent's own `/run` reply, kept as it was parsed.

A mounted agent's reply crosses the participant once: its body (what the agent's own `/run` wrote) is
parsed, validated as a `RunReply` (`protocol.wire.gym_reply`), and its canonical JSON written for the
digest the receipt names.  A real Gym agent's reply carries its model calls' token arrays, tens of
thousands of numbers at 9k tokens, so each pass over them shows in the agent's CPU
(benchmarks/peer.py: the mounted agent against the plain one).  The reply is kept as parsed
(`ParsedReply`): its JSON-valued fields hold the parser's values, which a dump would copy item by item
into equal ones (`RunReply.parsed_payload`; 6-7 ms a 9k reply), and it holds no number JSON cannot
carry (its validation refused those), so its canonical JSON leaves out that search.
"""

from __future__ import annotations

from protocol.wire import RunReply


class ParsedReply(RunReply):
    """A reply validated from JSON this process parsed (the agent's own `/run` body): its JSON-valued
    fields hold JSON values already, kept as they are (`parsed_payload`), never copied."""
