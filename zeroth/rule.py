def platform_name(name: str) -> str:
    """The platform family of a jax backend or device platform name: "cuda"/"rocm" -> "gpu"."""
    return "gpu" if name in ("cuda", "rocm", "gpu") else name
