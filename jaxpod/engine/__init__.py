"""One engine for every model: layout, state, loss and gradients, update, step."""
