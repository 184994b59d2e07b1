"""The API's HTTP server: a gunicorn ``gthread`` worker that reads each request whole, with
Go ``http.Server`` deadlines (:mod:`.worker`, :mod:`.connection`, :mod:`.request_frame`,
:mod:`.deadlines`).

It knows HTTP, not the API: it never imports the routes (``tests/unit/test_layering.py``
checks it). The API plugs in what it needs (the limits from the ``http`` config section and
its JSON error body) on a subclass built by :func:`services.api.gunicorn_conf.worker_class`.
It is a subpackage of the API, not a
``common`` module, because only the API process runs it (services never import each other,
and ``common`` holds what several processes share).
"""
