"""The private Ray and MLflow APIs this project needs, one module per library, each with a
contract test (tests/test_adaptors.py) that fails loudly when a version moves them."""
