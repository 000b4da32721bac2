"""``carpool up``: a broker and N workers on one host under one supervisor, and the page.

- :mod:`carpool.up.supervisor`: which children to start, restart and stop — pure.
- :mod:`carpool.up.plan`: each child's command line and metrics port — pure.
- :mod:`carpool.up.processes`: the shell that runs them (``subprocess.Popen``, signals).
- :mod:`carpool.up.feed`: the page's figures from STATS; :mod:`carpool.up.traffic`: the
  built-in clients; :mod:`carpool.up.page`: the HTTP server and who may use it;
  ``static/``: the page itself.
- :mod:`carpool.up.command`: the command line that wires them together.
"""
