"""The OpenAI API surface: protocol models, routes and the serving classes behind them."""
