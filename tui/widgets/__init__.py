"""One panel per mechanism; each renders a ``DashboardState`` and never touches the engine."""
