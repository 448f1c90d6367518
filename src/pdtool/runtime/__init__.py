"""`pd train`'s runtime: the plan's pipeline stages built from the model, and the workers that run them."""
