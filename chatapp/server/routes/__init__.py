"""One module per endpoint family; app.py mounts their routers."""
