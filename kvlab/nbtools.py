"""Small helpers for the notebooks: hardware presets, batch-vs-interactive, tables.

A notebook's ``parameters`` cell may hold ``"auto"``; the cell after it resolves each one with
``resolve(value, gpu=..., cpu=...)``: full sizes on a GPU, a tiny model and small sizes on a CPU.
The environment variable ``KVLAB_PRESET`` (``gpu`` | ``cpu`` | ``auto``) forces the choice; the
tests set ``cpu`` so a GPU machine still runs them in seconds.
"""

from __future__ import annotations

import math
import os
from html import escape

from . import devices, params


def parameters(namespace, notebook: str) -> dict:
    """The values of every parameter `notebook` declares (its ``parameters`` cell, read by kvlab.params),
    taken from `namespace` (the notebook's ``globals()``), ``run_dir`` left out: what ``results.start``
    records, so no notebook retypes its parameter list. `notebook`: a path or short name ("02_handoff").
    Raises KeyError naming a declared parameter the namespace lacks."""
    declared = params.notebook_parameters(params.find_notebook(notebook))
    missing = [n for n in declared if n != "run_dir" and n not in namespace]
    if missing:
        raise KeyError(f"the parameters {missing} of {notebook} are not defined here: run its parameters cell first")
    return {n: namespace[n] for n in declared if n != "run_dir"}


def resolve(value, *, gpu, cpu):
    """``value`` unless it is the string ``"auto"``; then ``gpu`` or ``cpu`` by ``preset()``.

    Example (the cell after ``parameters``): ``model = nbtools.resolve(model, gpu="qwen2.5-7b",
    cpu="kvlab-tiny")``.
    """
    if isinstance(value, str) and value == "auto":
        return gpu if devices.preset() == "gpu" else cpu
    return value


def is_interactive() -> bool:
    """True in a live Jupyter kernel (JupyterLab, Notebook, VS Code), where widgets can be used.

    False in plain Python and under batch execution: ``kvlab run`` and the tests set
    ``KVLAB_BATCH=1`` for the kernel, because papermill leaves no other trace a kernel can see.
    """
    if os.environ.get("KVLAB_BATCH", "").strip() not in ("", "0"):
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def format_number(x, digits: int = 3) -> str:
    """``digits`` significant digits, thousands separators, never scientific for |x| ≥ 1."""
    kind = getattr(getattr(x, "dtype", None), "kind", None)  # numpy scalars: "i", "u", "b", "f"
    if isinstance(x, bool) or kind == "b":
        return str(bool(x))
    if isinstance(x, int) or kind in ("i", "u"):
        return f"{int(x):,}"
    x = float(x)
    if math.isnan(x):
        return ""
    if math.isinf(x):
        return "∞" if x > 0 else "−∞"
    if x == 0 or abs(x) < 1:
        return f"{x:.{digits}g}"
    whole_digits = len(str(int(abs(x))))
    return f"{x:,.{max(digits - whole_digits, 0)}f}"


def show_table(df, digits: int = 3, caption: str | None = None, max_rows: int = 200) -> None:
    """Show a DataFrame without its index, numbers to ``digits`` significant digits.

    In a kernel (interactive or papermill) it displays both HTML and plain text, so the executed
    notebook reads well on GitHub and in a terminal; elsewhere it prints the text. ``max_rows``
    bounds what is shown (the full table belongs in the run's CSV, not on screen).
    """
    import pandas as pd

    if not isinstance(df, pd.DataFrame):
        raise TypeError(f"show_table needs a pandas DataFrame, got {type(df).__name__}")
    if not isinstance(digits, int) or digits < 1:
        raise ValueError(f"digits must be a positive int, got {digits!r}")
    shown = df.head(max_rows)
    formatters = {
        col: (lambda v, d=digits: format_number(v, d))
        for col in shown.columns
        if pd.api.types.is_numeric_dtype(shown[col]) and not pd.api.types.is_bool_dtype(shown[col])
    }
    text = shown.to_string(index=False, formatters=formatters)
    html = shown.to_html(index=False, formatters=formatters, border=0)
    if len(df) > max_rows:
        note = f"… {len(df) - max_rows:,} more rows (of {len(df):,})"
        text += "\n" + note
        html += f"<p><em>{note}</em></p>"
    if caption:
        text = f"{caption}\n{text}"
        html = f"<p><strong>{escape(caption)}</strong></p>{html}"
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        print(text)
        return
    if get_ipython() is None:
        print(text)
        return
    display({"text/plain": text, "text/html": html}, raw=True)


def show_findings(analysis) -> None:
    """A study's findings (kvlab.study.Analysis) as markdown in a kernel, as text elsewhere."""
    text = "\n".join(analysis.findings)
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
    except ImportError:
        print(text)
        return
    if get_ipython() is None:
        print(text)
        return
    display(Markdown(text))
