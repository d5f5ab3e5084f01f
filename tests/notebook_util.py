"""Helpers shared by the tests that execute notebooks."""


def text_outputs(nb) -> str:
    """All text a notebook printed or displayed (stream outputs and ``text/plain`` results)."""
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if o.get("output_type") == "stream":
                out.append(o["text"])
            elif "data" in o and "text/plain" in o["data"]:
                out.append(o["data"]["text/plain"])
    return "\n".join(out)


def printed(nb) -> list[str]:
    """What each code cell printed to stdout, one string per code cell."""
    return [
        "".join(
            o["text"] for o in c.get("outputs", []) if o.get("output_type") == "stream" and o.get("name") == "stdout"
        )
        for c in nb.cells
        if c.cell_type == "code"
    ]


def images(nb) -> list[int]:
    """How many PNG images each code cell displayed, one count per code cell."""
    return [
        sum("image/png" in o.get("data", {}) for o in c.get("outputs", [])) for c in nb.cells if c.cell_type == "code"
    ]


def run(notebook, cwd):
    """Execute ``notebook`` (a path) with the python3 kernel in folder ``cwd``; return the executed notebook."""
    import nbclient
    import nbformat

    nb = nbformat.read(notebook, as_version=4)
    nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
    ).execute()
    return nb


def execute(notebook, cwd) -> str:
    """Execute ``notebook`` (a path) with the python3 kernel in folder ``cwd``; return its text outputs."""
    return text_outputs(run(notebook, cwd))


def committed_outputs_match(notebook, cwd) -> tuple[str, object]:
    """Execute ``notebook`` on what it reads by default and check that it prints what its committed
    outputs say, cell by cell, and displays an image wherever the committed notebook shows one.

    Returns the printed text and the executed notebook; raises AssertionError naming the first
    cell that differs (the committed outputs are stale: re-execute the notebook and commit it).
    """
    import nbformat

    committed = nbformat.read(notebook, as_version=4)
    fresh = run(notebook, cwd)
    for i, (old, new) in enumerate(zip(printed(committed), printed(fresh))):
        assert old == new, f"{notebook}: code cell {i} prints\n{new}\nbut its committed output is\n{old}"
    assert images(committed) == images(fresh), (
        f"{notebook}: images per code cell {images(fresh)}, committed {images(committed)}"
    )
    assert sum(images(committed)) > 0, f"{notebook} is committed without its figures"
    return "".join(printed(fresh)), fresh
