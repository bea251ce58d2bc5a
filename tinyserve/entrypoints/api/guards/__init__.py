"""Request guards: what a request must pass before, or while, it is served (auth, limits, slow
clients, a strict body, the shutdown drain); none of them is a stage of the journey."""
