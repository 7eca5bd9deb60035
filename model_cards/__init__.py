"""Jinja templates of the Hub model cards (data files; rendered by ``tokenmaxx.heads.io.hub``)."""
