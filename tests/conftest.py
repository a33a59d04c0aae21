# Shared fixtures live in tests/fixtures/; list each module here so every test directory sees them.
pytest_plugins = ["tests.fixtures.nats", "tests.fixtures.models", "tests.fixtures.lm"]
