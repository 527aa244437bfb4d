from glob import glob

from setuptools import setup

PACKAGE = "so_arm_policy"

setup(
    name=PACKAGE,
    version="0.1.0",
    packages=[PACKAGE],
    data_files=[
        ("share/ament_index/resource_index/packages", [f"resource/{PACKAGE}"]),
        (f"share/{PACKAGE}", ["package.xml"]),
        (f"share/{PACKAGE}/launch", glob("launch/*.launch.py")),
        (f"share/{PACKAGE}/config", glob("config/*.yaml") + glob("config/*.rviz")),
        (f"share/{PACKAGE}/udev", glob("udev/*.rules")),
    ],
    install_requires=["setuptools"],
    zip_safe=True,
    maintainer="soarm maintainers",
    maintainer_email="maintainers@soarm.invalid",
    description="ROS 2 node running an exported soarm reach policy on the SO-ARM101",
    license="Apache-2.0",
    entry_points={"console_scripts": [f"reach_node = {PACKAGE}.reach_node:main"]},
)
