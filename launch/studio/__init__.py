"""``rlfleet studio``: a long-running local web app over a workdir's runs (``<workdir>/runs``):
start a run from a form, watch and compare runs, stop, resume or delete them, play an episode,
ask a language model, export and serve.

- launch.studio.book: the runs and the actions on them (`RunBook`).
- launch.studio.tasks: long commands on a run (video, export, ask) (`TaskBoard`).
- launch.studio.app: the Starlette app: the dashboard's page and endpoints plus ``/api/studio``.
- launch.studio.http: request and error handling shared by the routes.
- launch.studio.command: the ``rlfleet studio`` command.

The page is the dashboard's (launch/dashboard/static): one front end, which shows the studio's
views when ``/api/studio`` answers.
"""
