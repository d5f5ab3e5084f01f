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
