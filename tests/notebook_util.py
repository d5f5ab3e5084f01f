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


def execute(notebook, cwd) -> str:
    """Execute ``notebook`` (a path) with the python3 kernel in folder ``cwd``; return its text outputs."""
    import nbclient
    import nbformat

    nb = nbformat.read(notebook, as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    return text_outputs(nb)
