"""``tiercache ui``: a read-only local web page over a cache (needs the ``ui`` extra: Starlette, uvicorn).

:mod:`tiercache.ui.views` builds what the page shows as JSON from a cache's public methods;
:mod:`tiercache.ui.server` serves it with the page's static assets (``static/``: plain HTML, CSS
and JavaScript, shipped in the wheel, nothing fetched from elsewhere).
"""
