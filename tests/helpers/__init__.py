"""What the tests share that is not a fixture: constants, references and builders, one module per concern."""
