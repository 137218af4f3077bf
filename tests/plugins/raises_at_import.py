raise RuntimeError("cannot reach the license server\nmore detail")
