"""Text from a recipe written into job files: comments that cannot be broken out of.

Values the job runs are shell words (`shlex`) or YAML scalars (`yaml.safe_dump`); a comment is
neither, so a recipe file name with a newline would end it and start a command."""

from __future__ import annotations

import shlex


def comment_text(text: str) -> str:
    """`text` made safe for one comment line: control characters are shown escaped (`\\n`)."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def shell_word(word: str) -> str:
    """One shell word that stays on one line: `shlex.quote`, or bash's `$'...'` (with escapes) for
    a word holding control characters, so a script line never spans lines a reader would miss."""
    if all(ch.isprintable() for ch in word):
        return shlex.quote(word)
    escaped = "".join(ch if ch.isprintable() and ch not in "\\'" else
                      ("\\" + ch if ch in "\\'" else f"\\x{ord(ch):02x}" if ord(ch) < 256 else f"\\u{ord(ch):04x}")
                      for ch in word)
    return f"$'{escaped}'"


def shell_join(words) -> str:
    return " ".join(shell_word(w) for w in words)
