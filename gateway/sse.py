"""Server-sent event framing shared by the stream responses and stream errors."""

from __future__ import annotations

# JSON leaves U+0085, U+2028 and U+2029 unescaped, and SSE does not end a line there, but
# clients that split the stream with str.splitlines (httpx's aiter_lines, for one) do, and then
# read half a JSON object. Escaped, they decode to the same text. (Go's encoding/json escapes
# U+2028/U+2029 for the same kind of reader.) Model output carries them: byte-level BPE spells
# any character, and a soak of 8,000 random-prompt requests hit one.
_BREAKS_JSON_KEEPS = (("\x85", "\\u0085"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))


def sse_data(json_text: str) -> str:
    """One event: a `data:` line carrying json_text, and the blank line that ends the event."""
    if not json_text.isascii():
        for char, escaped in _BREAKS_JSON_KEEPS:
            json_text = json_text.replace(char, escaped)
    return f"data: {json_text}\n\n"
