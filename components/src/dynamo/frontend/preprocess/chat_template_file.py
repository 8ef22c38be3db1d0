"""`--chat-template FILE`: a Jinja chat template replacing the model's own.

Read and parsed once at start-up, so a missing file or a syntax error stops the frontend
with a message naming the file, rather than failing every chat request later.
"""

from __future__ import annotations

from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox


class ChatTemplateError(ValueError):
    """The file named by `--chat-template` cannot be used."""


def load_chat_template(path: str | Path) -> str:
    """The template's source, after checking that it parses as Jinja (with the loop
    controls Hugging Face templates use)."""
    file = Path(path)
    try:
        source = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"--chat-template {file}: cannot read it: {exc}") from None
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols])
    try:
        env.parse(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"--chat-template {file}: not a valid Jinja template (line {exc.lineno}): {exc.message}"
        ) from None
    return source
