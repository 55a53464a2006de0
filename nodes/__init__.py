"""The coordinator (ServerApp and round logic), the volunteer (ClientApp) and their launchers."""
