"""Deliberately not valid Python: importing it raises SyntaxError."""

def blobs(:
    pass
