"""What every layer shares, at the bottom of the import order (pyproject.toml's
import-linter contract): the request and its sampling parameters, its priority, the loop
detector's parameters, one step's schedule, and the attention interface. Nothing here
imports another headroom package."""
