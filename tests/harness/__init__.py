"""What several test modules share: fakes, clusters, browsers and checks. A test module imports
from here (or from its folder's helper modules), never another test module's private helpers."""
