"""The bytes of one HTTP/1.1 request, refused before anything is sent if they could be misread.

A request is written whole (request line, header fields as the caller gives them, `Content-Length`,
body), so its framing is one length the body always matches.  Every name, value and target is checked
against RFC 9110's grammar first: a CR, LF or NUL smuggled into any of them could end the header block
early and make the rest of it a second request, so such a request raises `httpx.LocalProtocolError`
and nothing goes on the wire.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import httpx

# RFC 9110 §5.6.2 token: field names and methods.
_TOKEN = rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+"
# RFC 9110 §5.5 field-value bytes: visible bytes, obs-text, space and tab; no CTL (CR, LF, NUL, DEL).
_VALUE = rb"[\t\x20-\x7e\x80-\xff]*"
# RFC 9112 §3.2 request-target: visible ASCII only (a URL's other bytes arrive percent-encoded).
_TARGET = rb"[\x21-\x7e]+"
# The whole head in one match (one call costs less than one per part); a CR or LF inside a value
# that itself reads as a header line would still match, which the count of line ends catches.
_HEAD = re.compile(_TOKEN + b" " + _TARGET + rb" HTTP/1\.1(?:\r\n" + _TOKEN + b": " + _VALUE + rb")*\r\n\r\n")
_IS_TOKEN = re.compile(_TOKEN)
_IS_VALUE = re.compile(_VALUE)
_IS_TARGET = re.compile(_TARGET)
# Field names already checked: callers send the same few names on every call.
_NAMES_SEEN: set[bytes] = set()
_MAX_NAMES_SEEN = 1024


def encode_request(method: str, target: bytes, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> bytes:
    """Request line, `headers` in the order given, `Content-Length` when there is a body, then `body`.

    `headers` must hold exactly one Host; a `Content-Length` given must match `body` (one is added
    for a non-empty body when none is given); `Transfer-Encoding` is refused (the body is sent whole).
    """
    try:
        verb = method.encode("ascii")
    except UnicodeEncodeError:
        raise httpx.LocalProtocolError(f"illegal method {method!r}") from None
    lines = [verb + b" " + target + b" HTTP/1.1"]
    hosts = 0
    length: bytes | None = None
    for name, value in headers:
        if name not in _NAMES_SEEN:
            if _IS_TOKEN.fullmatch(name) is None:
                raise httpx.LocalProtocolError(f"illegal header name {name!r}")
            if len(_NAMES_SEEN) < _MAX_NAMES_SEEN:
                _NAMES_SEEN.add(name)
        folded = name.lower()
        if folded == b"host":
            hosts += 1
        elif folded == b"content-length":
            if length is not None:
                raise httpx.LocalProtocolError("more than one Content-Length header")
            length = value
        elif folded == b"transfer-encoding":
            raise httpx.LocalProtocolError("Transfer-Encoding in a request: the body is sent whole")
        lines.append(name + b": " + value)
    if hosts != 1:
        raise httpx.LocalProtocolError(f"a request needs exactly one Host header, not {hosts}")
    if length is None:
        if body:
            lines.append(b"Content-Length: " + str(len(body)).encode())
    elif length != str(len(body)).encode():
        raise httpx.LocalProtocolError(f"Content-Length {length!r} for a body of {len(body)} bytes")
    lines.append(b"\r\n")
    head = b"\r\n".join(lines)
    if _HEAD.fullmatch(head) is None or head.count(b"\n") != len(lines):
        raise _culprit(verb, target, headers)
    return head + body


def _culprit(verb: bytes, target: bytes, headers: Sequence[tuple[bytes, bytes]]) -> httpx.LocalProtocolError:
    """The error naming the part of a refused head that broke it."""
    if _IS_TOKEN.fullmatch(verb) is None:
        return httpx.LocalProtocolError(f"illegal method {verb!r}")
    if _IS_TARGET.fullmatch(target) is None:
        return httpx.LocalProtocolError(f"illegal request target {target!r}")
    for name, value in headers:
        if _IS_VALUE.fullmatch(value) is None:
            return httpx.LocalProtocolError(f"illegal header value {value!r} of {name!r}")
    return httpx.LocalProtocolError("illegal request head")  # pragma: no cover - one part above fails
