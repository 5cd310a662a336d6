"""Building stores with a model: encoding a corpus block by block, coordinating ranks (torchrun), and
sharing one encoding among several stores."""
