"""One module a benchmark scenario: a function ``bN_...(b: Bench) -> dict`` the harness runs."""
