"""One module per op: public functions, fake kernels, autograd and references side by side."""
