"""The `tierserve` console script: `main` and one module per command."""
